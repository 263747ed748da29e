"""gbmpo: group policy optimisation with the divergence geometry as a first-class knob."""

__version__ = "0.1.0"
