"""The reference models (a byte-level transformer, its mixture-of-experts variant) and the vendored data they train on."""
