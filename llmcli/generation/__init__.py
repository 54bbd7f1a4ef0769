"""Generation: sampling maths (`sampling`), the batched loop (`generate`) with its context window
(`context_window`) and one-token step (`decode`), the text around it (`prompts`, `sample`), and
CPU threads (`threads`)."""
