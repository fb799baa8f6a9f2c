"""CLI subcommands, one module each; heavy imports stay inside the handlers so `ragkv --help` is instant."""
