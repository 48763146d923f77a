"""Around the engine: the command line (cli.py), tracing, benchmarks, the roofline, the book's tables, figures and
checks, and the transformers reference."""
