"""What --quantization takes (pdserve/loader/quantization.py says what each one loads)."""

QUANTIZATION_CHOICES = ("gguf", "none", "q8_0", "q4_0", "w8a8")
