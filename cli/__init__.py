"""moeckpt command line."""
