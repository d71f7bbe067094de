"""`python -m ac_observe.daemon.cli`: the same app as the `ac-observe` script, every command
registered (`ac-observe up` starts its children this way)."""
from ac_observe.daemon.cli import main

main()
