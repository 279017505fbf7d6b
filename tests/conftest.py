import torch

# The suite runs tiny models on a 2-core machine: one intra-op thread is as fast and cannot be slowed
# 10-100x by oversubscription when something else is running.
torch.set_num_threads(1)


def pytest_configure(config) -> None:
    """Ignore the library warnings the run console ignores (calls we cannot change), from their lists."""
    from compose.quiet import LOADING_WARNINGS
    from lightning_modules.pipeline.console import NOISE_WARNINGS

    for message, category in NOISE_WARNINGS + LOADING_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:{message}:{category.__name__}")
