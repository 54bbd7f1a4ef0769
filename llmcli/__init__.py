"""llmcli: train, sample and inspect small causal language models."""

__version__ = "0.1.0"
