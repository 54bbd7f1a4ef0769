"""Generation: sampling maths (`sampling`), the plain loop to read (`loop`), the batched, cached
engine that commands run (`engine`: its context window and left padding) with its faster
one-token step (`fast_decode`, the default) and the compiled one (`compiled_decode`, `sample
--compile`), the text around it (`prompts`, `detokenize`, `streaming`, `batching`, `sample`,
`interactive`, `chat`), and CPU threads (`threads`)."""
