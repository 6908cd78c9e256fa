"""Server side of the DSL: executes shipped `@k3rt.function` programs next to the engine."""
