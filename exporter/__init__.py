"""PC-side exporter: a Hugging Face LLM -> per-layer ONNX files + manifest.json (installs as
`edgelite_export`). See DESIGN.md beside this file."""
