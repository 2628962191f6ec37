"""`python -m jaxllm.server [MODEL] [flags]`: the same as `jaxllm serve`."""

import argparse
import logging

from jaxllm.engine.args import parse_cli_args
from jaxllm.server.cli import add_serve_args, run_serve

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    parser = argparse.ArgumentParser(prog="python -m jaxllm.server", description=__doc__)
    run_serve(parse_cli_args(add_serve_args(parser)))
