"""KV cache transfer between prefill and decode nodes (docs/architecture.md: KV transfer).

Public API: KVTransferConfig, KVArgs/PeerLayout, TransferManager (one per node), KVSender
(prefill, one per request), KVReceiver (decode, one per request), KVPoll.
Nothing here imports torch or the engine; buffers are raw pointers.
"""

from kv_transfer.args import KVArgs, PeerLayout
from kv_transfer.backends import BackendUnavailable, available_backends, mooncake_import_error
from kv_transfer.config import KVTransferConfig
from kv_transfer.manager import TransferManager
from kv_transfer.poll import KVPoll
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender

__all__ = [
    "BackendUnavailable", "KVArgs", "PeerLayout", "TransferManager", "KVPoll", "KVReceiver",
    "KVSender", "KVTransferConfig", "available_backends", "mooncake_import_error",
]
