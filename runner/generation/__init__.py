"""Inference: decoding, data-parallel and pipelined generation, big-model placement by device_map, and the
generate task's orchestration (as torchtune's generation/)."""
