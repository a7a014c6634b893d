"""Several ranks: the job's ranks and their watchdog (world.py), the workers `fastml run` starts (launch.py), the
collectives behind one interface (collectives.py; the host-routed memcpy ones, hostcomm.py), and data parallelism
with ZeRO sharding (shard.py)."""
