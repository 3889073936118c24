"""The distribution wing: where a generation runs when it is more than one device of one process.

  pmap       data parallel over the local devices: a full copy of the weights on each (jax.pmap)
  mesh       a (data, model) mesh: the batch split over "data" (a loop per data shard, shard_map), the weights
             over "model"; on one process or several
  messages   what process 0 sends the others (load, generate, stop), packed as arrays
  multihost  process 0 leads, the others follow its messages

It sits above the decoding core (whose `decode_loop` every placement runs unchanged) and checkpoint reading.
"""
