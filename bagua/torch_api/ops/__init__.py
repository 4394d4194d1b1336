"""Bucket operations: what a bucket does when it is ready (compressed, decentralized, async, DiLoCo exchanges)."""
