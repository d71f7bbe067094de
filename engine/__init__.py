"""The bundled ac-observe inference engine.

NOTE: importing this package must stay cheap and torch-free: the daemon and CLI import
`engine.skeleton` and `engine.config` on nodes that have no PyTorch. Heavy modules
(`engine.llm_engine`, `engine.model`, ...) are imported where they are used.
"""
