"""A deployment of several processes: `pdserve launch` (the plan and start order), its supervisor, and the
cluster secret that lets the members know each other."""
