"""The users' two-pass workload (primary then rescue prompt on the same image) and its inputs."""
