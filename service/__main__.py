from service.cli import app

app()
