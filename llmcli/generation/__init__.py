"""Generation: sampling maths (`sampling`), the plain loop to read (`loop`), the batched, cached
engine that commands run (`engine`: its context window and left padding) with an opt-in faster
one-token step (`fast_decode`), the text around it (`prompts`, `detokenize`, `streaming`,
`batching`, `sample`, `interactive`, `chat`), and CPU threads (`threads`)."""
