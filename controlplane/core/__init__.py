"""Settings, database and security primitives of the control plane."""
