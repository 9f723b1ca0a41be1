from pdserve.model.decoder import DecoderModel
from pdserve.model.forward_batch import ForwardBatch, SequenceChunk
from pdserve.model.load import default_device, load_config, load_decoder, resolve_dtype

__all__ = ["DecoderModel", "ForwardBatch", "SequenceChunk", "default_device", "load_config", "load_decoder",
           "resolve_dtype"]
