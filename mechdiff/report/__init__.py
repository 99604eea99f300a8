"""Tables, figures and the study report."""
