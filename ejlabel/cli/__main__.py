from ejlabel.cli.main import main

raise SystemExit(main())
