"""kvstate across machines: what one server tells a fleet (KV events a router reads).

``kv_events`` publishes which blocks each tier holds, in vLLM's KV-event format over ZMQ, so an
existing router (NVIDIA Dynamo's KV router, llm-d's indexer) can send each conversation to the
server that holds most of its prefix. It needs the ``fleet`` extra (``pyzmq``, ``msgspec``).
"""
