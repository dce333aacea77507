"""medusa-chat: a local chat app that answers faster with Medusa tree decoding."""

__version__ = "0.1.0"
