"""semkv's vLLM adapter. Import ``semkv_vllm.connector`` for the connector class.

NOTE: this package is imported in vLLM's API-server, engine-core and worker processes; its
top level imports nothing heavy.
"""
