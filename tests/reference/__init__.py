# tests/reference: plain-PyTorch reference implementations used by the tests.
