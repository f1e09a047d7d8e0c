"""`kvserve replay`: drive the real prefix caches over a request trace, without a model."""
