"""In-process experiments: the runner on a virtual clock, the experiment catalogue, the results page."""
