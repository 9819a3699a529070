"""`pdserve decode`."""

from pdserve.node.node_cli import add_node_parser


def add_parser(sub) -> None:
    add_node_parser(sub, "decode")
