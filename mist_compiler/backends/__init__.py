"""Backends: stage-program code generation and the torch.distributed runtime that executes plans."""
