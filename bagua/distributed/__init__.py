"""Launchers: thin wrappers that add Bagua's flags to ``torch.distributed.run`` and call it."""
