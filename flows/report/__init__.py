"""What a campaign's rows tell: the HTML report, its figures, and the experiment-tracker sinks."""
