"""Configuration: the engine config and the flags generated from it, roles, FastDeploy's flags."""
