"""The engine layer: everything that touches llama.cpp (through llama-cpp-python) lives
here, and nowhere else in the project. `llama.LlamaEngine` is the engine; the rest are its
parts (samplers, vocabulary, KV reuse, speculation, backends and repacking probes).

Nothing is imported here on purpose: llama_cpp must be loaded only after the worker has
pinned itself to its device (CUDA_VISIBLE_DEVICES is read when the library loads)."""
