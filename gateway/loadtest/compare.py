"""placeholder"""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None: ...
def run(args: argparse.Namespace) -> int:
    return 0
