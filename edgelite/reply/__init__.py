"""The reply side: what turns a model's logits into a reply, with no ONNX in it. The reply loop
and its rules (loop.py: sampling.py, stops, JSON constraints jsonprefix.py/jsonschema.py, tool
calls tools.py), the tokenizer and chat templates (tokenizer.py), speculation (speculate.py),
embeddings' pooling (embed.py), and what drives a reply over a model backend (backend.py,
generate.py). It sits beside engine/ (which runs the model) and imports neither engine/ nor
anything above it; the node never imports it."""
