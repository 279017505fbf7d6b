import torch

# The suite runs tiny models on a 2-core machine: one intra-op thread is as fast and cannot be slowed
# 10-100x by oversubscription when something else is running.
torch.set_num_threads(1)
