"""edgelite: one LLM split across several phones, as a pipeline of ONNX stages."""

__version__ = "0.1.0"
