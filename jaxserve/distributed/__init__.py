"""What runs one model over several devices, processes or machines.

- `meshes`: the device mesh and the shardings of weights and KV caches
  (tensor parallelism), placed or abstract (compile-only targets).
- `multihost`: one mesh over several processes, one scheduler (the leader sends
  each step's plan to the followers).
- `data_parallel`: replicas of the engine behind one front, routed by prefix.
- `ray_replicas`: those replicas as Ray actors on a cluster's machines, with
  `progress_watch` telling a long step from a stuck one.

The package imports nothing itself: each module is loaded where it is used.
"""
