"""Plain communication on torch.distributed: process groups, collectives, their lifecycle, coalescing, hierarchy."""
