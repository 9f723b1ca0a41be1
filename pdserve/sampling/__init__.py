from pdserve.sampling.sampler import Sampler, SamplerOutput, SamplingRow, check_stop, make_generator
from pdserve.sampling.sampling_params import SamplingParams

__all__ = ["SamplingParams", "Sampler", "SamplingRow", "SamplerOutput", "check_stop", "make_generator"]
