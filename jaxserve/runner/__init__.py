"""Host -> device: building fixed-shape step inputs and running the jitted step."""
