"""GGUF export for llama.cpp: which llama.cpp architecture holds a run (`architectures`), its
byte-level BPE vocabulary as GGUF metadata (`vocab`), and the file itself (`export`)."""
