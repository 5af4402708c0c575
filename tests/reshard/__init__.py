"""Tests of the engine (moeckpt.reshard): the planner, offline reshards, loads, read-once and the rank exchange."""
