"""Tests of the library (import moeckpt, moeckpt.dcp): save / load of state dicts and torch DCP through moeckpt."""
