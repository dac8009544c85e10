"""`aibro worker`: the agent on an instance. It pulls its assignment, trains with Keras, streams events,
uploads checkpoints and artifacts, then stays warm for its cool-down."""
