"""keras-io corpus recipes and stand-in data for benchmarks/keras_io_corpus.py (issue 35 item 5)."""
