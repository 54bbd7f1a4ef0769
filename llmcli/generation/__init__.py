"""Generation: sampling maths (`sampling`), the batched loop (`generate`) over its context window
(`context_window`, left `padding`), an opt-in faster one-token step (`fast_decode`), the text
around it (`prompts`, `sample`, `interactive`), and CPU threads (`threads`)."""
