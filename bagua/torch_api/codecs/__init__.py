"""Codecs (MinMaxUInt8, block-wise uint8/uint4), error-feedback residuals, and the compressed allreduces on them."""
