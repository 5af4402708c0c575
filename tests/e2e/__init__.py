"""End-to-end tests: the demo, the elastic and signal drills that run whole jobs, and what a fresh install needs."""
