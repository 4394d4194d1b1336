"""Plain communication on torch.distributed: process groups, collectives, their lifecycle, coalescing, hierarchy,
groups of one's own (``own_group``) and the communication thread (``worker``)."""
